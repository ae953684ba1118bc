"""GradProbeConfig: msprobe's grad_probe config.json loads unchanged; every value the reference accepts silently
is rejected at load time with a message naming the file, the key, the bad value and what is accepted."""
import json
import re

import pytest

from msprobe_mlflow.config import GradProbeConfig

# The sample of msprobe 1.0.3's grad_probe documentation (doc/grad_probe/grad_probe.md), byte for byte.
MSPROBE_GRAD_PROBE_EXAMPLE = """{
 "task": "grad_probe",
 "dump_path": "./dump_path", 
 "rank": [],  
 "step": [],  
 "grad_probe": {
     "grad_level": "L1",
     "param_list": [],
     "bounds": [-1, 0, 1]
 }
}
"""


def write_config(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def valid_config(**changes):
    data = {"task": "grad_probe", "dump_path": "./dump_path", "rank": [], "step": [],
            "grad_probe": {"grad_level": "L1", "param_list": [], "bounds": [-1, 0, 1]}}
    section = changes.pop("grad_probe", {})
    data["grad_probe"].update(section)
    data.update(changes)
    return data


def test_msprobe_documentation_example_loads_unchanged(tmp_path):
    config = GradProbeConfig.from_json(write_config(tmp_path, MSPROBE_GRAD_PROBE_EXAMPLE))
    assert (config.dump_path, config.level, config.bounds) == ("./dump_path", "L1", (-1, 0, 1))
    assert (config.rank, config.step, config.param_list) == ((), (), ())
    assert config.direction_format == "packed"


def test_the_other_tasks_sections_of_msprobe_config_are_ignored(tmp_path):
    # msprobe's shipped config/config.json holds every task's section and top-level keys of its own.
    data = valid_config(level="L1", seed=1234, is_deterministic=False, enable_dataloader=False, acl_config="",
                        statistics={"scope": [], "list": [], "data_mode": ["all"], "summary_mode": "statistics"},
                        run_ut={"white_list": [], "black_list": [], "error_data_path": "./"})
    data["grad_probe"] = {"grad_level": "L2", "param_list": ["fc1.weight"], "bounds": [-0.1, 0, 0.1]}
    config = GradProbeConfig.from_json(write_config(tmp_path, data))
    assert (config.level, config.param_list, config.bounds) == ("L2", ("fc1.weight",), (-0.1, 0, 0.1))


def test_values_are_read_as_given(tmp_path):
    data = valid_config(rank=[0, 3], step=[0, 5, 9], dump_path="/data/dump", direction_format="npy",
                        grad_probe={"grad_level": "L0", "param_list": ["a.weight", "b.bias"], "bounds": [0.01]})
    config = GradProbeConfig.from_json(write_config(tmp_path, data))
    assert config.rank == (0, 3) and config.step == (0, 5, 9) and config.dump_path == "/data/dump"
    assert config.level == "L0" and config.param_list == ("a.weight", "b.bias") and config.bounds == (0.01,)
    assert config.direction_format == "npy"
    assert config.wants_step(5) and not config.wants_step(6)
    assert config.wants_param("a.weight") and not config.wants_param("a.weigh")


def test_missing_grad_probe_section_uses_the_documented_defaults(tmp_path):
    config = GradProbeConfig.from_json(write_config(tmp_path, {"task": "grad_probe", "dump_path": "out"}))
    assert (config.level, config.bounds, config.param_list, config.rank, config.step) == \
        ("L1", (-1, 0, 1), (), (), ())


def test_overrides_win_over_the_file(tmp_path):
    path = write_config(tmp_path, valid_config())
    config = GradProbeConfig.from_json(path, dump_path=str(tmp_path / "elsewhere"), level="L2")
    assert config.dump_path == str(tmp_path / "elsewhere") and config.level == "L2"


def test_msprobe_dict_round_trip():
    config = GradProbeConfig(dump_path="d", level="L2", bounds=(-0.5, 0.25), param_list=("w",), rank=(1,),
                             step=(2, 4), direction_format="npy")
    assert GradProbeConfig.from_dict(json.loads(json.dumps(config.to_msprobe_dict()))) == config


# (what is changed, the key the message must name, a fragment of what is accepted)
BAD_CASES = {
    "string in step": (valid_config(step=["1"]), "step", "'1'", "non-negative integers"),
    "comma string as step": (valid_config(step="1,2"), "step", "'1,2'", "non-negative integers"),
    "negative step": (valid_config(step=[-1]), "step", "-1", "non-negative integers"),
    "boolean step": (valid_config(step=[True]), "step", "True", "non-negative integers"),
    "string in rank": (valid_config(rank=["0"]), "rank", "'0'", "non-negative integers"),
    "float rank": (valid_config(rank=[0.5]), "rank", "0.5", "non-negative integers"),
    "string param_list": (valid_config(grad_probe={"param_list": "fc1"}), "grad_probe.param_list", "'fc1'",
                          "list of exact parameter names"),
    "number in param_list": (valid_config(grad_probe={"param_list": [3]}), "grad_probe.param_list", "[3]",
                             "list of exact parameter names"),
    "empty bounds": (valid_config(grad_probe={"bounds": []}), "grad_probe.bounds", "[]", "non-empty list"),
    "unsorted bounds": (valid_config(grad_probe={"bounds": [1, 0]}), "grad_probe.bounds", "[1, 0]",
                        "strictly ascending"),
    "repeated bound": (valid_config(grad_probe={"bounds": [0, 0, 1]}), "grad_probe.bounds", "[0, 0, 1]",
                       "strictly ascending"),
    "non-numeric bound": (valid_config(grad_probe={"bounds": [-1, "0", 1]}), "grad_probe.bounds", "'0'",
                          "finite numbers"),
    "boolean bound": (valid_config(grad_probe={"bounds": [False, True]}), "grad_probe.bounds", "False",
                      "finite numbers"),
    "bounds not a list": (valid_config(grad_probe={"bounds": 0.5}), "grad_probe.bounds", "0.5", "non-empty list"),
    "bounds equal in float32": (valid_config(grad_probe={"bounds": [1.0, 1.00000001]}), "grad_probe.bounds",
                                "1.00000001", "float32"),
    "bound rounding to float32 inf": (valid_config(grad_probe={"bounds": [0, 3.4028236e38]}), "grad_probe.bounds",
                                      "3.4028236e+38", "float32"),
    "bound beyond float32": (valid_config(grad_probe={"bounds": [0, 1e39]}), "grad_probe.bounds", "1e+39",
                             "float32"),
    "level L3": (valid_config(grad_probe={"grad_level": "L3"}), "grad_probe.grad_level", "'L3'", "L0, L1, L2"),
    "lower-case level": (valid_config(grad_probe={"grad_level": "l2"}), "grad_probe.grad_level", "'l2'",
                         "exact case"),
    "level in a list": (valid_config(grad_probe={"grad_level": ["L1"]}), "grad_probe.grad_level", "['L1']",
                        "L0, L1, L2"),
    "misspelt grad_probe key": (valid_config(grad_probe={"grad_levle": "L2"}), "grad_probe", "grad_levle",
                                "grad_level, param_list, bounds"),
    "missing dump_path": ({"task": "grad_probe", "grad_probe": {}}, "dump_path", "None", "the key is missing"),
    "empty dump_path": (valid_config(dump_path=""), "dump_path", "''", "non-empty folder path"),
    "null dump_path": (valid_config(dump_path=None), "dump_path", "None", "non-empty folder path"),
    "unknown task": (valid_config(task="statistics"), "task", "'statistics'", '"grad_probe"'),
    "unknown direction_format": (valid_config(direction_format="pt"), "direction_format", "'pt'", "packed, npy"),
    "grad_probe not an object": ({**valid_config(), "grad_probe": ["L1"]}, "grad_probe", "['L1']",
                                 "an object"),
    "top level not an object": ([1, 2], "(top level)", "[1, 2]", "a JSON object"),
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_value_is_rejected_naming_file_key_value_and_what_is_accepted(tmp_path, case):
    data, key, shown_value, accepted = BAD_CASES[case]
    path = write_config(tmp_path, data)
    with pytest.raises(ValueError) as error:
        GradProbeConfig.from_json(path)
    message = str(error.value)
    assert message.startswith(f"{path}: {key} = "), message
    assert shown_value in message and accepted in message, message


def test_invalid_json_names_the_file(tmp_path):
    path = write_config(tmp_path, '{"task": "grad_probe",')
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": not valid JSON"):
        GradProbeConfig.from_json(path)


def test_the_dataclass_validates_like_the_file():
    with pytest.raises(ValueError, match=r"GradProbeConfig: grad_probe\.bounds = \(\) is not accepted"):
        GradProbeConfig(dump_path="d", bounds=())
    with pytest.raises(ValueError, match=r"grad_probe\.grad_level = 'L9'"):
        GradProbeConfig(dump_path="d").replace(level="L9")


def test_a_json_file_that_is_no_grad_probe_config_is_named_as_such(tmp_path):
    """A comparison's verdict.json (no task key at all) passed where config.json belongs."""
    path = write_config(tmp_path, {"verdict": {"suspicious": True}, "sources": ["a", "b"]}, name="verdict.json")
    with pytest.raises(ValueError) as error:
        GradProbeConfig.from_json(path)
    assert str(error.value) == (f"{path}: no task key (top-level keys: sources, verdict); expected msprobe's "
                                f"grad_probe config.json, with \"task\": \"grad_probe\" (the only task this tool "
                                f"runs), \"dump_path\" and a \"grad_probe\" section")
