"""``fastamp-compare``: memory, speed and convergence of mixed-precision regimes, end to end.

Trains small real models on data this module generates (no downloads) under each regime
and prints, per model, the table practitioners choose by: peak memory, step time and speed
ratio to fp32, final loss and convergence as a % of fp32, skipped steps and final loss
scale. Writes a CSV of the table, a CSV of the per-step curves and a PNG (loss curves, loss
scale over steps, memory and speed).

Models:
  ``gpt``  a GPT-style character-level transformer (token + position embeddings, causal
           self-attention, LayerNorm, GELU MLP) on text from a small synthetic grammar.
  ``cnn``  a small CNN with BatchNorm (the layer the AMP guides warn about in fp16) on
           synthetic 10-class images, normalised (zero mean, std about 1.6).
  ``cnn-raw12`` the same CNN on the same images delivered as raw 12-bit sensor values
           (integers 0..4095, not normalised, as a camera RAW or a depth / medical sensor
           gives them). The first convolution's outputs then have a variance near 1e6:
           fine in fp16 as values, but above fp16's largest number (65504) as BatchNorm's
           running variance. Only the regimes that show the difference run there (on CPU
           by default fp32, fastamp-fp16 and half-fp16-fastamp; with ``--full`` also
           torch-amp-fp16 and pure-fp16).

Regimes:
  ``fp32``            fp32 params, ``torch.optim.AdamW(fused=True)``.
  ``torch-amp-fp16``  fp32 params, ``autocast(fp16)`` + ``torch.amp.GradScaler`` + fused AdamW.
  ``fastamp-scaler-fp16`` ``torch-amp-fp16`` with ``fastamp.Scaler`` in place of ``torch.amp.GradScaler``,
                      nothing else changed: its losses, loss scales and skipped steps must equal
                      torch's bit for bit (the report checks it).
  ``torch-amp-bf16``  fp32 params, ``autocast(bf16)`` + fused AdamW (bf16 needs no scaler).
  ``fastamp-fp16``    ``fastamp.cast_model(model, fp16)`` (norm layers stay fp32, casts at their
                      boundaries) + fp32 masters in ``fastamp.optim.AdamW`` + ``fastamp.Scaler``,
                      under ``autocast(fp16)``.
  ``fastamp-bf16``    ``cast_model(model, bf16)`` + fp32 masters, under ``autocast(bf16)``.
  ``fastamp-bf16-remainder``  the same with ``master_weights="remainder"``: int16 remainders
                      instead of fp32 masters (exact, 2 bytes per param less).
  ``fastamp-bf16-release`` ``fastamp-bf16-remainder`` with gradient release
                      (``fastamp.release(model, opt, max_norm=clip)``): each bucket stepped inside
                      backward and its grads freed; its losses must equal its twin's bit for bit
                      (the report checks it). gpt only.
  ``fastamp-bf16-sr`` the same without masters, ``stochastic_rounding=True, seed=0``.
  ``fastamp-bf16-10B`` remainder masters + bf16 moments with stochastic rounding (10 bytes per
                      param: param 2, remainder 2, moments 2 + 2, grad 2).
  ``fastamp-bf16-remainder-q8`` ``master_weights="remainder", state_format="q8"``: the exact int16
                      remainder master and 8-bit block-scaled moments (8.06 bytes per param with the
                      grad at large tensors). gpt only, as the other q8 rows.
  ``fastamp-bf16-ulp8-q8`` ``master_weights="ulp8", state_format="q8"``: an int8 master correction and
                      8-bit moments (7.06). Named ``fastamp-bf16-q8`` before the other q8 rows came.
  ``fastamp-bf16-sr-q8`` ``stochastic_rounding=True, state_format="q8"``: no master, 8-bit moments (6.06).
  ``fastamp-fp16-ulp8-q8`` ``fastamp-fp16`` (fp16 params, ``fastamp.Scaler``) with
                      ``master_weights="ulp8", state_format="q8"`` (7.06).
                      Tensors under 4,096 elements keep fp32 moments in every q8 row (and an exact
                      master under ulp8): the report's training-state table gives the B/param of
                      the model and of its large tensors, which the 7B projection uses.
  ``half-fp16-fastamp`` ``model.half()`` (BatchNorm / LayerNorm in fp16 too) with everything
                      else as ``fastamp-fp16``: isolates what ``cast_model`` changes.
  ``pure-fp16``       plain ``model.half()`` (BatchNorm and LayerNorm included), torch AdamW on the
                      fp16 params, no masters, no scaler, no autocast: the guides' cautionary row.
  ``pure-bf16``       the same in bf16.

Which regimes run: on CPU by default (``MODEL_REGIMES``) gpt runs every regime but
``half-fp16-fastamp`` (the four q8 rows included: a q8 step of the transformer costs about what
the other bf16 rows' does), cnn every one without fp16, release or q8, cnn-raw12 ``fp32``,
``fastamp-fp16`` and ``half-fp16-fastamp`` (the BatchNorm point): fp16 CNN steps are the costly
ones on a CPU.
``--full`` (and the default on CUDA, ``FULL_MODEL_REGIMES``) adds the other fp16 CNN rows;
``--regimes`` runs the given ones on every model.

Every scaler, torch's and fastamp's, runs with the same settings: start at 2^16, x0.5 and a
skipped step on an overflow, x2 after ``--growth-interval`` clean steps (10 in the CPU-sized
run, so that the scale is seen to move). The report lists the skipped steps of each regime,
torch's and fastamp's side by side, the pitfall guards that fired (recorded per regime, not
printed), and the CPU's features next to the measured speeds.

Timing: on CPU with one torch thread (the default; ``--threads``), every regime of every
model advances a block of 4 steps in turn (the first untimed: it finds the previous regime's
data in the caches), each timed step timed by the process's CPU time and the wall clock; the
table shows the lower quartile of the timed steps. The machine's load (other processes,
steal) is measured before and during the run, and a run under load says so in the report and
on the PNG (``load``). Three steps per regime are profiled op by op (``hotspots``): the report
says which ops took the time.

Usage::

    fastamp-compare                                  # all models, CPU default set, CPU-sized
    fastamp-compare --full                           # every regime on CPU too (fp16 CNN rows: slow)
    fastamp-compare --size tiny                      # seconds: a smoke run
    python -m fastamp.compare --device cuda --size large --steps 600
    fastamp-compare --model gpt --regimes fp32,torch-amp-bf16,fastamp-bf16 --steps 100

Layout, in the order a run goes through it: ``data`` and ``models`` (what is trained),
``regimes`` (how each regime sets the model and optimizer up), ``train`` (one regime's
steps, timed; ``memory`` measures the peak of a step, ``hotspots`` profiles one), ``load``
(the machine's load), ``progress`` (the progress line and its ETA), ``report`` (ratios to
fp32, verdicts, Markdown), ``plots`` (the PNG), ``cli`` (arguments, the interleaved schedule,
files; ``python -m fastamp.compare`` runs it). The machine header and CSV / Markdown writers
are ``fastamp._harness``, shared with the microbenchmarks.
"""

from fastamp.compare.cli import MODELS, SIZES, CompareRun, build_parser, main, run
from fastamp.compare.data import _NUMBERS as _NUMBERS  # private; the tests use it
from fastamp.compare.data import ImageData, TextData, synthetic_text
from fastamp.compare.hotspots import OpProfile, profile_step
from fastamp.compare.load import LoadVerdict, assess
from fastamp.compare.machine import cpu_features, cpu_features_line, cpu_flags
from fastamp.compare.memory import CpuPeakMeter, CudaPeakMeter, live_bytes
from fastamp.compare.models import SmallCNN, TinyGPT, bn_running_var_max
from fastamp.compare.plots import plot
from fastamp.compare.progress import JobProgress, eta_seconds
from fastamp.compare.regimes import (
    BN_DEMO_REGIMES,
    FASTAMP_OPTIONS,
    FULL_MODEL_REGIMES,
    MODEL_REGIMES,
    Q8_REGIMES,
    REGIME_INFO,
    REGIMES,
    build_regime,
)
from fastamp.compare.report import (
    CONVERGENCE_RTOL,
    SCALE_PAIRS,
    TABLE_COLS,
    cpu_speed_note,
    guard_lines,
    markdown,
    scale_lines,
    scale_moves,
    scale_trajectories_match,
    summarise,
    verdicts,
)
from fastamp.compare.train import RegimeResult, RegimeRun, pitfalls_recorded, train_regime
from fastamp.compare.train import _lr_at as _lr_at  # private; the tests use it
from fastamp.compare.train import _step_count as _step_count  # private; the tests use it

__all__ = [
    "BN_DEMO_REGIMES",
    "CONVERGENCE_RTOL",
    "FASTAMP_OPTIONS",
    "FULL_MODEL_REGIMES",
    "MODELS",
    "MODEL_REGIMES",
    "Q8_REGIMES",
    "REGIMES",
    "REGIME_INFO",
    "SCALE_PAIRS",
    "SIZES",
    "TABLE_COLS",
    "CompareRun",
    "CpuPeakMeter",
    "CudaPeakMeter",
    "ImageData",
    "JobProgress",
    "LoadVerdict",
    "OpProfile",
    "RegimeResult",
    "RegimeRun",
    "SmallCNN",
    "TextData",
    "TinyGPT",
    "assess",
    "bn_running_var_max",
    "build_parser",
    "build_regime",
    "cpu_features",
    "cpu_features_line",
    "cpu_flags",
    "cpu_speed_note",
    "eta_seconds",
    "guard_lines",
    "live_bytes",
    "main",
    "markdown",
    "pitfalls_recorded",
    "plot",
    "profile_step",
    "run",
    "scale_lines",
    "scale_moves",
    "scale_trajectories_match",
    "summarise",
    "synthetic_text",
    "train_regime",
    "verdicts",
]
