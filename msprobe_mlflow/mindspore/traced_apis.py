"""What the MindSpore operator trace wraps (:mod:`msprobe_mlflow.mindspore.operator_trace`), named as msprobe 1.0.3
names its MindSpore dump entries: every public function of ``mindspore.mint`` (``Mint.add``) and of
``mindspore.mint.nn.functional`` (``MintFunctional.linear``); of ``mindspore.ops`` (``Functional.dense``) and of
``mindspore.Tensor`` (``Tensor.__add__``) the ones msprobe 1.0.3 lists (its ``support_wrap_ops.yaml``, copied here so
that tracing needs no msprobe install); the primitives a network's cells hold (``Primitive.dense``, as msprobe's L1
dump with a model). Names a MindSpore version lacks are skipped."""
from __future__ import annotations

MINT, MINT_FUNCTIONAL, FUNCTIONAL, TENSOR, PRIMITIVE, JIT = \
    "Mint", "MintFunctional", "Functional", "Tensor", "Primitive", "Jit"

# msprobe 1.0.3's list of mindspore.ops functions (support_wrap_ops.yaml, "ops")
MSPROBE_OPS = tuple("""
    adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d adaptive_max_pool1d adaptive_max_pool2d
    avg_pool1d avg_pool2d avg_pool3d batch_norm bias_add ctc_greedy_decoder conv1d conv2d conv3d
    deformable_conv2d dense dropout dropout1d dropout2d dropout3d flatten fold fractional_max_pool3d lp_pool1d
    lp_pool2d lrn max_pool2d max_pool3d max_unpool1d max_unpool2d max_unpool3d unfold binary_cross_entropy
    binary_cross_entropy_with_logits cosine_embedding_loss cross_entropy ctc_loss gaussian_nll_loss
    hinge_embedding_loss huber_loss kl_div l1_loss margin_ranking_loss mse_loss multi_margin_loss
    multilabel_margin_loss multilabel_soft_margin_loss nll_loss smooth_l1_loss triplet_margin_loss elu fast_gelu
    gelu glu gumbel_softmax hardshrink hardsigmoid hardswish hardtanh leaky_relu log_softmax logsigmoid mish
    prelu relu relu6 celu rrelu selu sigmoid silu softmax softmin softshrink softsign tanh threshold cdist dist
    pdist choice_with_mask random_categorical log_uniform_candidate_sampler uniform_candidate_sampler
    affine_grid bounding_box_decode bounding_box_encode col2im check_valid crop_and_resize grid_sample
    interpolate iou pad padding pixel_shuffle pixel_unshuffle upsample abs absolute accumulate_n acos arccos
    acosh add addcdiv addcmul addmv addn angle arccosh arcsin arcsinh arctan arctanh arctan2 asin asinh atan
    atan2 atanh atleast_1d atleast_2d atleast_3d bessel_i0 bessel_i0e bessel_i1 bessel_i1e bessel_j0 bessel_j1
    bessel_k0 bessel_k0e bessel_k1 bessel_k1e bessel_y0 bessel_y1 bitwise_and bitwise_left_shift bitwise_or
    bitwise_right_shift bitwise_xor ceil clamp clip combinations copysign cos cosh cosine_similarity cov
    diag_embed diff deg2rad digamma div divide erf erfc erfinv exp exp2 expm1 floor floor_div floor_mod
    float_power fmod frac gcd hypot igamma igammac imag i0 inv invert lcm ldexp lerp log log2 log10 log1p
    logaddexp logaddexp2 logical_and logical_not logical_or logical_xor logit mul multiply mvlgamma neg negative
    nextafter polar polygamma positive pow rad2deg ravel real reciprocal remainder rot90 round rsqrt sgn sign
    signbit sin sinc sinh sqrt square sub subtract t tan tanhshrink trapz tril_indices triu_indices true_divide
    trunc truncate_div truncate_mod xdivy xlogy zeta all amax amin aminmax any argmax argmin cummax cummin
    cumprod cumsum fmax histc logsumexp max mean median min norm prod std std_mean var var_mean argsort
    approximate_equal equal ge greater greater_equal gt intopk isclose isfinite isinf isnan isneginf isposinf
    isreal is_complex le less less_equal lt maximum minimum msort ne not_equal searchsorted topk bmm addbmm
    addmm baddbmm addr adjoint cholesky cholesky_solve batch_dot dot eig inner inverse geqrf ger kron lu_solve
    lu_unpack matmul matrix_solve matrix_band_part matrix_diag matrix_diag_part matrix_set_diag mm mv outer
    orgqr ormqr pinv svd tensor_dot logdet slogdet qr trace bartlett_window blackman_window hamming_window
    hann_window kaiser_window eye fill full full_like linspace logspace one_hot arange range heaviside bernoulli
    gamma laplace multinomial multinomial_with_replacement rand rand_like randint randint_like randn randn_like
    random_gamma random_poisson randperm standard_laplace standard_normal uniform argwhere batch_to_space_nd
    bincount block_diag broadcast_to cat channel_shuffle chunk column_stack concat conj count_nonzero deepcopy
    diag diagflat diagonal dyn_shape dsplit dstack einsum expand expand_dims flip fliplr flipud gather_d
    gather_elements gather_nd hsplit hstack index_add index_fill index_select inplace_add inplace_index_add
    inplace_sub inplace_update masked_fill masked_select meshgrid moveaxis movedim narrow nan_to_num nansum
    normal nonzero population_count rank repeat_elements repeat_interleave reshape reverse reverse_sequence roll
    scatter scatter_nd select sequence_mask shuffle size slice sort space_to_batch_nd sparse_segment_mean split
    squeeze stack strided_slice sum swapaxes swapdims tensor_scatter_add tensor_scatter_div tensor_scatter_max
    tensor_scatter_min tensor_scatter_mul tensor_scatter_sub tensor_scatter_elements tensor_split tile tril triu
    transpose unbind unique unique_consecutive unique_with_pad unsorted_segment_max unsorted_segment_min
    unsorted_segment_prod unsorted_segment_sum unsqueeze unstack view_as_real vsplit vstack where cross renorm
    is_tensor scalar_cast scalar_to_tensor tuple_to_array clip_by_global_norm clip_by_value assign assign_add
    assign_sub scatter_add scatter_div scatter_max scatter_min scatter_mul scatter_nd_add scatter_nd_div
    scatter_nd_max scatter_nd_min scatter_nd_mul scatter_nd_sub scatter_update derivative jet
""".split())

# msprobe 1.0.3's list of mindspore.Tensor methods (support_wrap_ops.yaml, "tensor")
MSPROBE_TENSOR_METHODS = tuple("""
    __abs__ __add__ __and__ __bool__ __eq__ __ge__ __gt__ __iadd__ __ifloordiv__ __imatmul__ __imod__ __imul__
    __isub__ __le__ __lt__ __matmul__ __mod__ __mul__ __ne__ __neg__ __or__ __pow__ __radd__ __rmatmul__
    __rmod__ __rmul__ __rpow__ __rsub__ __sub__ __truediv__ __xor__ abs absolute acos acosh add addbmm addcdiv
    addcmul addmm addmv addr all amax amin any arccos arccosh argmax angle arcsin arcsinh arctan arctanh argmin
    argsort asin asinh atan atan2 atanh baddbmm bernoulli bincount bitwise_and bitwise_or bitwise_xor bmm bool
    broadcast_to ceil cholesky_solve cholesky clamp clip conj copysign cos cosh cross cummax cummin cumprod
    cumsum deg2rad diag diagflat diff digamma div divide equal erf erfc erfinv exp expand_as expm1 flip fliplr
    flipud float_power floor fmod frac gather_elements ge geqrf ger greater greater_equal gt half hardshrink
    heaviside histc hypot i0 igamma igammac imag index_add index_fill index_put index_select inner int inverse
    isclose isfinite isinf isnan is_complex is_signed isneginf isposinf isreal lcm ldexp le lerp less less_equal
    log log10 log1p log2 logaddexp logaddexp2 logdet logical_and logical_not logical_or logical_xor logit
    logsumexp long lt masked_fill masked_scatter masked_select matmul max maximum mean median min minimum
    moveaxis movedim msort multinomial multiply mvlgamma nan_to_num nansum narrow ne neg negative nelement
    new_ones new_zeros nextafter norm nonzero not_equal ormqr permute pow prod qr ravel real reciprocal
    remainder renorm rad2deg tile repeat_interleave reshape round rot90 rsqrt sum_to_size scatter sgn short
    sigmoid sign signbit sin sinc sinh slogdet sort split sqrt square squeeze std subtract svd swapaxes swapdims
    t take tan tanh trace to topk tril tensor_split transpose true_divide trunc unbind unique_consecutive
    unsqueeze var view where xlogy from_numpy copy diagonal flatten resize sum
""".split())
