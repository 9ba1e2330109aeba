"""Shared test helpers: small models of any head mix, built through the public API."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

if shutil.which("nvidia-smi") is None:  # as in the Makefile; set before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in Triton's interpreter on CPU

import pytest  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED_DATA = Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared" / "data"))
# lm-eval is installed by `make install` (dev extras), but not on an image with its own packages (the GPU campaign's)
EVAL_EXTRA = pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None,
                                reason="the eval extra (pip install -e '.[eval]') is not installed")

# Where the Triton kernels' tests run: CPU tensors in Triton's interpreter, else compiled on a GPU (the tests then
# check the kernels that training runs, on CUDA tensors), else nowhere
TRITON_DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda" if torch.cuda.is_available() else None
TRITON_KERNELS = pytest.mark.skipif(TRITON_DEVICE is None, reason="compiled Triton kernels need a GPU, and "
                                    "TRITON_INTERPRET=1 (which runs them on CPU) is not set")

torch.set_num_threads(min(2, torch.get_num_threads()))

# The test files with CUDA paths of their own (fused and varlen Triton kernels, flash-attn dispatch); the rest of
# the suite runs on CPU tensors on any machine, but for single tests marked `cuda`
CUDA_FILES = ("test_gathered.py", "test_gathered_tiled.py", "test_varlen.py", "test_attention.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On a GPU, CUDA_FILES' tests and those marked `cuda` elsewhere run first (the order within each part kept): a
    session there with a time limit (the GPU campaign's, bench/gpu_campaign.sh) has their results even if it stops
    before the end (on the H200, 2026-11-29, the GPU run of test_train.py's deterministic kernels was among the 141
    tests cut)."""
    if torch.cuda.is_available():
        items.sort(key=lambda item: item.path.name not in CUDA_FILES and item.get_closest_marker("cuda") is None)


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that imports this repository: one torch thread (the same in every run), the
    repository first on PYTHONPATH and what PYTHONPATH already held after it (e.g. packages installed with
    `pip --target`, as on the GPU image), plus `extra`."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **extra}


def tiny_config(heads: list[dict] | None = None, **model):
    """A small validated Config; `heads` is a list of {type, count, options} dicts."""
    import lm

    values = dict(vocab_size=97, n_layers=2, d_model=32, head_dim=8, seq_len=64)
    values.update(model)
    cfg = lm.load_config(None, **{f"model.{k}": v for k, v in values.items()})
    if heads is not None:
        from lm.config import HeadGroupConfig

        cfg.model.heads = [HeadGroupConfig(h["type"], h["count"], dict(h.get("options", {}))) for h in heads]
        from lm.config import validate

        validate(cfg)
    return cfg


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def spy_on_compile(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The backend of every torch.compile call from now on (each still compiles)."""
    backends: list[object] = []
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **k: backends.append(k.get("backend")) or real(*a, **k))
    return backends
