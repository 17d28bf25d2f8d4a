"""The one tolerance table of the test suite. Each budget says why it is not zero.

Where the maths allows, tests compare bit for bit (``torch.equal``) and use nothing here.

A bit-for-bit comparison must hold on every x86-64 CPU, so it may only rest on results that
are exact or correctly rounded by definition: IEEE + - * / (torch's elementwise kernels use
the hardware instructions), dtype conversions, comparisons, integer maths, ``math.sqrt``
and ``fastamp.reference.sqrt_rn`` (fp64 root rounded once), or on two runs of the same torch
kernels on the same machine with the same thread count. Never on torch's CPU ``sqrt``,
``rsqrt``, ``pow``, ``exp``, ``log``, ``tanh``, on ops that may fuse a multiply-add
(``add(alpha=)``, ``addcmul``, ``addcdiv``, ``lerp``) or on float reductions (``sum``,
norms): their last bit depends on the CPU vendor, the instruction set torch dispatches to
and, for reductions, the thread count (``benchmarks/portable_ops_check.py`` measures it;
e.g. fp32 ``sqrt`` is one ulp off on ~17% of inputs on an AMD EPYC and ~0.7% on a Xeon).
Comparisons with such torch results use a budget below.
"""

# Sum of squares for the global norm: the reference accumulates in fp64, the kernels in
# fp32 per fixed-size chunk and fp64 across chunks; with n up to ~1e7 elements the fp32
# chunk sums carry a relative error of about chunk_len * 2^-24 in the worst case, ~1e-6
# in practice. Relative tolerance.
SUMSQ_RTOL = 1e-5

# Global grad norm vs torch.nn.utils.clip_grad_norm_ (which sums per-tensor fp32 norms
# in fp32, in an order set by the instruction set, and takes torch's sqrt): relative.
NORM_RTOL = 1e-5

# fastamp AdamW vs torch.optim.AdamW (fused or foreach) on fp32 params: torch's foreach path
# uses torch.lerp / addcdiv kernels that may contract to FMA (lerp does on AVX2, not with
# ATEN_CPU_CAPABILITY=default), we do not, and its fp32 sqrt is not correctly rounded (how
# often depends on the CPU vendor); a few ulps per step, accumulated over the steps of a
# test. Absolute, on params of magnitude ~1.
ADAMW_VS_TORCH_ATOL = 1e-5
ADAMW_VS_TORCH_RTOL = 1e-5

# Triton on a real GPU vs the reference: Triton may use approximate sqrt / division and
# FMA contraction; under the CPU interpreter it is bit-exact. Relative, per element.
ADAMW_GPU_RTOL = 1e-6

# fastamp SGD vs torch.optim.SGD on fp32 params: torch's add(alpha=) (weight decay, dampened
# momentum, the param update) may contract a*b+c into one FMA on CPU, we round the product
# first (reference.sgd_): up to 1 ulp per operation per step, then carried by the momentum
# buffer (amplified by at most 1/(1-momentum) = 10 for momentum 0.9). Measured: <= 1e-6 abs
# after 300 steps on params up to ~13. Absolute and relative, per element.
SGD_VS_TORCH_ATOL = 1e-5
SGD_VS_TORCH_RTOL = 1e-5

# Stochastic rounding is unbiased: the mean of R draws (each within one rounding step of the
# value, so standard deviation <= 1/2 step) lies within this many standard errors of the value.
# The tests use fixed seeds, so they are deterministic; 6 standard errors keeps a correct
# implementation passing for any seed (chance of a false failure below 1e-8 per checked value)
# while a bias of a few percent of a step, at R = 4096, fails (6 * 0.5 / 64 = 0.047 step).
SR_MEAN_SIGMAS = 6

# fastamp Lion vs its rule computed in fp64 from the same fp32 state, one step at a time: each
# fp32 result of the kernels is a short chain of correctly rounded operations (at most three
# roundings on any path: a product, a sum, the final difference, plus the fp32 rounding of lr
# and 1 - lr*wd), so it lies within 3 units of 2^-24 of the sum of the magnitudes of the terms
# it adds (e.g. |beta1*m| + |(1-beta1)*g| for the sign's argument). Relative to those sums.
LION_STEP_RTOL = 3 * 2.0**-24
