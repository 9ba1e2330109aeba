"""What a training run logged to TensorBoard (<trainer.out_dir>/tb), read back as numbers."""
from __future__ import annotations

from pathlib import Path


def tb_scalars(run: Path, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard scalar a training run in `run` (trainer.out_dir) logged ({} before any
    event file holds it: TensorBoard writes its events to disk every two minutes and at the end)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values: dict[int, float] = {}
    for events in (run / "tb").glob("events.out.tfevents.*"):  # train and validation writers
        acc = EventAccumulator(str(events))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values |= {e.step: e.value for e in acc.Scalars(tag)}
    return values
