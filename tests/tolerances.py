"""The one tolerance table of the test suite. Each budget says why it is not zero.

Where the maths allows, tests compare bit for bit (``torch.equal``) and use nothing here.
"""

# Sum of squares for the global norm: the reference accumulates in fp64, the kernels in
# fp32 per fixed-size chunk and fp64 across chunks; with n up to ~1e7 elements the fp32
# chunk sums carry a relative error of about chunk_len * 2^-24 in the worst case, ~1e-6
# in practice. Relative tolerance.
SUMSQ_RTOL = 1e-5

# Global grad norm vs torch.nn.utils.clip_grad_norm_ (which sums per-tensor fp32 norms
# in fp32): relative.
NORM_RTOL = 1e-5

# fastamp AdamW vs torch.optim.AdamW (fused or foreach) on fp32 params: torch's foreach path
# uses torch.lerp / addcdiv kernels that may contract to FMA, we do not; a few ulps per
# step, accumulated over the steps of a test. Absolute, on params of magnitude ~1.
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
