"""Named accelerators: memory and dense peak FLOP/s of one torch device, for MFU
(titanite.device.peak.peak_flops, by the name the device reports) and for planning runs on machines
that are not this one (`titanite estimate --device-name NAME`).

Units, for every row:
- One torch device, i.e. one rank: a GPU; on Trainium one logical NeuronCore (see below).
- `memory_gib`: the vendor's capacity, read as GiB (HBM stacks come in binary sizes, so "80 GB"
  is 80 GiB of chips); a process can allocate somewhat less.
- `bf16_tflops`: the dense matrix peak (without 2:4 sparsity, which datasheets often quote).
- `fp32_tflops`: the dense peak a float32 matmul runs at with PyTorch's defaults. On NVIDIA that
  is plain FP32, not TF32: `torch.backends.cuda.matmul.allow_tf32` is off by default and
  titanite leaves it off. None where the vendor publishes no FP32 figure: MFU then measures one
  (device.measured_peak) or takes metrics.peak_tflops.

Trainium: torch-neuronx gives each process one logical NeuronCore. On Trn2 and Trn3 the default
logical NeuronCore is 2 physical cores (LNC=2, 4 per chip), on Trn1 one core (2 per chip), so
those rows hold the chip's figures / 4 and / 2. A run with NEURON_LOGICAL_NC_CONFIG=1 on Trn2 or
Trn3 has half of that per rank: set metrics.peak_tflops and --device-memory-gib.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_NVIDIA_DATASHEET = "NVIDIA datasheet"
_NEURON_DOCS = "AWS Neuron architecture docs"


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: float
    bf16_tflops: float
    fp32_tflops: float | None
    source: str  # where the numbers come from
    aliases: tuple[str, ...] = ()  # other names a device may report (matched like `name`)

    def peak_tflops(self, dtype: torch.dtype) -> float | None:
        """The dense peak for matmuls in `dtype`: bf16's for bfloat16, fp32's otherwise."""
        return self.bf16_tflops if dtype == torch.bfloat16 else self.fp32_tflops

    def peak_source(self, dtype: torch.dtype) -> str:
        """Where peak_tflops(dtype) comes from, for logs: e.g. "H100 table, bf16"."""
        return f"{self.name} table, {'bf16' if dtype == torch.bfloat16 else 'fp32'}"


_TABLE = (
    # Hopper. H800, GH200 and H200 are the H100 SXM's silicon and clocks (H800: less NVLink and
    # FP64; GH200: with a Grace CPU, 96 GB HBM3 (a 144 GB HBM3e one exists); H200: HBM3e).
    Accelerator("H100", 80, 989, 67, _NVIDIA_DATASHEET + " (H100 SXM)"),
    Accelerator("H100 PCIe", 80, 756, 51, _NVIDIA_DATASHEET),
    Accelerator("H100 NVL", 94, 835, 60, _NVIDIA_DATASHEET),
    Accelerator("H800", 80, 989, 67, "H100 SXM's compute"),
    Accelerator("GH200", 96, 989, 67, "H100 SXM's compute"),
    Accelerator("H200", 141, 989, 67, _NVIDIA_DATASHEET + " (H200 SXM)"),
    # Blackwell: B200 as in HGX B200 (1,000 W), GB200 as in GB200 NVL72 (1,200 W).
    Accelerator("B200", 180, 2250, 75, _NVIDIA_DATASHEET + " (HGX B200)"),
    Accelerator("GB200", 186, 2500, 80, _NVIDIA_DATASHEET + " (GB200 NVL72)"),
    # Ampere (A800: the A100 with less NVLink) and Ada.
    Accelerator("A100", 80, 312, 19.5, _NVIDIA_DATASHEET),
    Accelerator("A100 40GB", 40, 312, 19.5, _NVIDIA_DATASHEET, aliases=("A100-SXM4-40GB", "A100-PCIE-40GB")),
    Accelerator("A800", 80, 312, 19.5, "A100's compute"),
    Accelerator("L40S", 48, 362, 91.6, _NVIDIA_DATASHEET),
    Accelerator("L40", 48, 181, 90.5, _NVIDIA_DATASHEET),
    Accelerator("L4", 24, 121, 30.3, _NVIDIA_DATASHEET),
    # AMD CDNA 3: fp32 is the FP32 matrix peak (ROCm runs float32 GEMMs on the matrix cores).
    Accelerator("MI300X", 192, 1307.4, 163.4, "AMD specifications"),
    Accelerator("MI325X", 256, 1307.4, 163.4, "AMD specifications"),
    # Intel Gaudi 3: the MME's BF16 matrix peak; Intel publishes no FP32 matrix figure.
    Accelerator("Gaudi3", 128, 1835, None, "Intel Gaudi 3 specifications", aliases=("Gaudi 3",)),
    # AWS Trainium, per logical NeuronCore (module docstring). Trn1 chip: 2 NeuronCore-v2, 32 GiB,
    # 190 BF16 / 47.5 FP32 TFLOP/s. Trn2 chip: 8 NeuronCore-v3, 96 GiB, 667 BF16 / 181 FP32.
    # Trn3 chip: 8 NeuronCore-v4, 144 GiB, 671 BF16 / 183 FP32.
    Accelerator("Trainium1", 32 / 2, 190 / 2, 47.5 / 2, _NEURON_DOCS, aliases=("trn1", "NeuronCore-v2")),
    Accelerator("Trainium2", 96 / 4, 667 / 4, 181 / 4, _NEURON_DOCS, aliases=("trn2", "NeuronCore-v3")),
    Accelerator("Trainium3", 144 / 4, 671 / 4, 183 / 4, _NEURON_DOCS, aliases=("trn3", "NeuronCore-v4")),
)

# Longest key first, so that "GH200" is tried before "H200" and "H100 PCIe" before "H100".
_KEYS = sorted(((key, acc) for acc in _TABLE for key in (acc.name, *acc.aliases)), key=lambda k: -len(k[0]))


def lookup(name: str) -> Accelerator | None:
    """The accelerator whose name (or alias) occurs in `name`, ignoring case, e.g.
    "NVIDIA H100 80GB HBM3" -> H100. A key must not be part of a longer model number: "A100" does
    not match "RTX A1000", nor "L4" "L40"."""
    for key, acc in _KEYS:
        if re.search(rf"(?<![a-z0-9]){re.escape(key.lower())}(?![0-9])", name.lower()):
            return acc
    return None


def names() -> list[str]:
    """The accelerators' names, for help texts and errors."""
    return [acc.name for acc in _TABLE]
