"""A language model's throughput: tokens per second, and on GPUs the model FLOPs utilisation (MFU).

FLOPs per token, as the PaLM paper (appendix B) and nanoGPT's ``estimate_mfu`` count them: ``6 N``
for the forward and backward matmuls of N parameters (2 in the forward, 4 in the backward), plus
``12 L C T`` for attention's scores and weighted sum over a context of T tokens (L blocks of width
C; the built-in gpt's options, or ``n_layer``/``n_embd`` given to a user's model). Embedding
lookups are no matmul, so N leaves out the embedding tables unless one is also the head's weight
(tied). MFU is the achieved FLOPs per second over the hardware's peak for the run's precision,
summed over the GPUs (``--peak-tflops``, else the table below by the device's name).
"""

from __future__ import annotations

from typing import Any

from torch import nn

# Dense peak TFLOPS per GPU (no sparsity), from the vendors' data sheets: (fp32 / tf32, bf16 and fp16).
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (494.5, 989.0),
    "H100": (494.5, 989.0),  # SXM; the PCIe card is ~0.76 of it: give --peak-tflops
    "A100": (156.0, 312.0),
    "L40S": (183.0, 362.0),
    "L4": (60.0, 121.0),
    "A10G": (35.0, 70.0),
    "A10": (62.5, 125.0),
    "V100": (15.7, 125.0),
    "T4": (8.1, 65.0),
}


def flops_per_token(model: nn.Module, model_record: dict[str, Any], block_size: int) -> float:
    """Training FLOPs per token: ``6 N + 12 L C T``, N without the embedding tables (a lookup is no
    matmul) unless a table is also a Linear's weight (tied to the head); the attention term only
    when the model's options say L and C. ``model`` may be on the meta device."""
    linear = {id(module.weight) for module in model.modules() if isinstance(module, nn.Linear)}
    lookups = {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, nn.Embedding) and id(module.weight) not in linear
    }
    matmul_params = sum(p.numel() for p in model.parameters() if id(p) not in lookups)
    flops = 6.0 * matmul_params
    layers, width = model_record.get("n_layer"), model_record.get("n_embd")
    if isinstance(layers, int) and isinstance(width, int):
        flops += 12.0 * layers * width * block_size
    return flops


def peak_tflops(device_name: str | None, precision: str, stated: float | None = None) -> float | None:
    """Per-GPU peak for ``precision``: ``--peak-tflops`` if given, else the table's entry whose
    name appears in the device's (longest first, so "A100" never matches an "A10" card); None on CPU
    or an unknown card."""
    if stated is not None:
        return stated
    if not device_name:
        return None
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if name in device_name.upper().replace("NVIDIA", ""):
            fp32, half = PEAK_TFLOPS[name]
            return fp32 if precision == "fp32" else half
    return None


def lm_throughput(
    samples_per_second: float | None,
    block_size: int | None,
    num_workers: int,
    flops: float | None = None,
    peak: float | None = None,
) -> dict[str, float | None]:
    """The summary's ``tokens_per_second`` (global), ``tokens_per_second_per_worker`` and ``mfu``
    (None without a peak: CPUs, unknown cards)."""
    if not samples_per_second or block_size is None:
        return {}
    tokens = samples_per_second * block_size
    mfu = model_flops_utilisation(tokens, flops, peak, num_workers) if flops and peak else None
    return {"tokens_per_second": tokens, "tokens_per_second_per_worker": tokens / num_workers, "mfu": mfu}


def throughput_text(samples_per_second: float, block_size: int | None, num_workers: int) -> str:
    """The epoch line's throughput of a language model (tokens/s); nothing for other tasks."""
    if block_size is None:
        return ""
    tokens = samples_per_second * block_size
    return f"  {tokens:,.0f} tokens/s ({tokens / num_workers:,.0f} per worker)"


def model_flops_utilisation(tokens_per_second: float, flops: float, peak: float, num_gpus: int) -> float:
    """The share of ``num_gpus`` GPUs' peak (``peak`` TFLOPS each) that ``tokens_per_second`` at
    ``flops`` training FLOPs a token achieves."""
    return tokens_per_second * flops / (peak * 1e12 * num_gpus)
