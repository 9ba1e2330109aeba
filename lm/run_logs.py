"""What a training run logged to TensorBoard (<trainer.out_dir>/tb), read back as numbers."""
from __future__ import annotations

from pathlib import Path


def _created(events: Path) -> tuple[int, int, int]:
    """events.out.tfevents.<seconds>.<host>.<pid>.<n> -> (seconds, pid, n): the order the files were opened in."""
    seconds, *_, pid, n = events.name.removeprefix("events.out.tfevents.").split(".")
    return int(seconds), int(pid), int(n)


def tb_scalars(run: Path, tag: str) -> dict[int, float]:
    """{step: value} of one TensorBoard scalar a training run in `run` (trainer.out_dir) logged, as TensorBoard
    shows it ({} before any event file holds it). The event files (a process's train and validation writers; one
    set per resume) are read in the order they were opened, and a resumed run's purge mark (a SessionLog START at
    step S, lm.train.tensorboard_logger) drops what was logged at steps >= S before it, as TensorBoard does, so the
    values an abandoned timeline logged after its checkpoint never mask the resumed run's."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    from tensorboard.util.tensor_util import make_ndarray

    values: dict[int, float] = {}
    for events in sorted((run / "tb").glob("events.out.tfevents.*"), key=_created):
        for event in EventFileLoader(str(events)).Load():
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                values = {step: v for step, v in values.items() if step < event.step}
            for v in event.summary.value:
                if v.tag == tag:
                    values[event.step] = v.simple_value if v.HasField("simple_value") else float(make_ndarray(v.tensor))
    return values
