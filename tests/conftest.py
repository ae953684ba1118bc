"""Process-wide settings every test process needs before its first framework op."""
import mindspore

# An op without a kernel on this CPU leaves the next ops failing too unless launch blocking was switched on
# before the process's first MindSpore op; the API checker switches it on, but only the first call counts.
mindspore.runtime.launch_blocking()
