"""SIGTERM (a scheduler's preemption notice) stops training at an optimizer step every rank agrees on, checkpointed.

Lightning's own SIGTERM handling is not safe with several processes: its signal handler runs a broadcast (a
collective inside a signal handler) and each rank stops at its own batch end (Lightning issues #20806, #20825),
so ranks that get the signal together, as under SLURM, Kubernetes or torchrun, deadlock or die with a gloo / NCCL
error. Measured with 2 CPU processes (tests/test_ddp.py's set-up, SIGTERM to the process group): 1 hang and 2
tracebacks in 3 runs, never the one-line stop. So here, from the start of training or validation on (Lightning
installs its handler just before), the handler only sets a flag. At the end of every optimizer step not
validated next (`StepCheckpoints.validates`: every val_every steps, and the last one under DeepSpeed), and after
every validation within training, the ranks reduce it (any rank: one integer, `reduce_boolean_decision`); if
any rank got the signal, all of them checkpoint that step (lm/checkpoint.StepCheckpoints.save, unless written
already) and stop there together, with Lightning's SIGTERMException (after a training step at the next batch's
start, once Lightning has logged the step), which lm.train turns into `Interrupted` (one line, exit status 143).
A validation in progress is completed first (`data.val_batches` batches), so a step's checkpoint carries its
validation. A signal after the last step's check, or in a validation
of its own (the first, or the final one), is agreed on when that call ends (lm.train.sigterm_interrupts), which
checkpoints what the call completed before stopping. One process takes the same path without the reduction.

SIGINT (Ctrl-C in the terminal, which sends it to every rank) takes the same path, with one line saying so; a
second Ctrl-C aborts at once (Python's KeyboardInterrupt: the steps since the last checkpoint are lost). Exit
status 128 + the signal: 143 for SIGTERM, 130 for SIGINT. Before training starts Ctrl-C is a plain
KeyboardInterrupt.
"""
from __future__ import annotations

import signal
import sys
from types import FrameType
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lm.accumulation import ends_step
from lm.checkpoint import StepCheckpoints


class Preemption(L.Callback):
    """The SIGTERM / SIGINT flag (`received`: this process got one, `signum` the first) and the agreed stop after an
    optimizer step (`stopped`: some rank got it), module docstring."""

    def __init__(self, checkpoints: StepCheckpoints) -> None:
        self.checkpoints = checkpoints
        self.received = self.stopped = False
        self.signum = signal.SIGTERM  # what a rank reports that stopped because another one got a signal
        self._sigint_before: Any = None  # the SIGINT handler before the first _install, restored at teardown

    def _flag(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            self.signum = signal.Signals(signum)
        self.received = True
        if signum == signal.SIGINT:  # the next Ctrl-C is Python's KeyboardInterrupt again: abort at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("Ctrl-C: stopping after this step, checkpointed (Ctrl-C again to abort at once, losing the steps "
                  "since the last checkpoint)", file=sys.stderr, flush=True)

    def _install(self) -> None:  # SIGTERM over Lightning's, whose teardown restores the earlier handler
        signal.signal(signal.SIGTERM, self._flag)
        if self._sigint_before is None:
            self._sigint_before = signal.getsignal(signal.SIGINT)
        if not self.received:
            signal.signal(signal.SIGINT, self._flag)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Ctrl-C is KeyboardInterrupt again after a fit or validation (what follows has no step to stop after)."""
        if self._sigint_before is not None:
            signal.signal(signal.SIGINT, self._sigint_before)
            self._sigint_before = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def _agreed(self, trainer: L.Trainer) -> bool:
        """Whether some rank got SIGTERM (a collective: every rank is here); then this step is checkpointed."""
        if not trainer.strategy.reduce_boolean_decision(self.received, all=False):
            return False
        if self.checkpoints.saved_step != trainer.global_step:
            self.checkpoints.save(trainer)
        self.stopped = True
        return True

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """After an optimizer step, unless the step validates next (then after that validation). The stop itself
        comes at the next batch's start, so that Lightning still logs this step's training values (it does after
        this hook); after the last step the fit ends anyway and lm.train.sigterm_interrupts sees `stopped`."""
        if ends_step(trainer, batch_idx) and not self.checkpoints.validates(trainer):
            self._agreed(trainer)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.stopped:
            raise SIGTERMException

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """After a validation within training (StepCheckpoints, earlier in the callback list, has saved its step
        if that is a checkpoint step; its values are logged). A validation on its own (trainer.validate) runs to
        its end: lm.train reads `received` after it."""
        if trainer.state.fn == "fit" and self._agreed(trainer):
            raise SIGTERMException


def received_sigterm(trainer: L.Trainer) -> bool:
    """Whether this process got SIGTERM or SIGINT, or stopped because another rank did, in trainer's fits and
    validations (through Preemption, or through Lightning's SIGTERM handler in the moments before Preemption replaces
    it)."""
    return trainer.received_sigterm or any(c.received or c.stopped for c in trainer.callbacks
                                           if isinstance(c, Preemption))


def stop_signal(trainer: L.Trainer) -> signal.Signals:
    """The signal this process stopped for: the first it got, SIGTERM if it stopped because another rank got one."""
    return next((c.signum for c in trainer.callbacks if isinstance(c, Preemption)), signal.SIGTERM)
