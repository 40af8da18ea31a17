"""The explorer's actions: Run, Stop and New model, training on a background thread.

:class:`Runner` owns the training thread, the history of calls and the latest measured
timeline; each run goes to the model's :class:`~ipukit.widgets.session.TrainingSession`
(one per model, so each keeps its weights). Errors are shown, never raised into a dead thread.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any, Callable, Dict, List, Optional

from ..core.errors import Error
from . import logic
from .dashboard import Dashboard
from .data import ExplorerData
from .logic import Config
from .session import TrainingSession


class Runner:
    """Trains the explorer's model with ipukit, call by call, on a background thread.

    ``on_done(config, record)`` is called after a run that made at least one call,
    ``on_error()`` after the run error changed; each measured call is drawn over the same
    call modeled from ``costs_for(config)``. ``lock`` is held while compiling.
    """

    def __init__(self, dashboard: Dashboard, models: Dict[str, Any], data: ExplorerData,
                 lock, on_done: Callable[[Config, Dict[str, Any]], None],
                 on_error: Callable[[], None], costs_for: Callable[[Config], logic.CostTable],
                 evaluate: bool = True, test_limit: Optional[int] = None) -> None:
        self.dashboard, self.models, self.data = dashboard, models, data
        self._sessions: Dict[str, TrainingSession] = {}
        self.evaluate_after_run = evaluate
        self.history: List[Dict[str, Any]] = []
        self.test_accuracy: Optional[float] = None
        self.measured_timeline = None
        self.run_error: Optional[str] = None
        self.failed = False                # the run error is not an ipukit.Error
        self._lock, self._on_done, self._on_error = lock, on_done, on_error
        self._costs_for, self._test_limit = costs_for, test_limit
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    running = property(lambda self: self._thread is not None and self._thread.is_alive())

    def session_for(self, name: str) -> TrainingSession:
        """The training session of model ``name``: its network, optimiser and data."""
        if name not in self._sessions:
            model = self.models[name]
            self._sessions[name] = TrainingSession(model.factory, model.wrap,
                                                   self.data.train_dataset,
                                                   self.data.test_dataset)
        return self._sessions[name]

    #: busy fraction of each virtual IPU in the latest measured call ({} before a run)
    measured_utilisation = property(
        lambda self: logic.utilisation_record(self.measured_timeline)["per_ipu"])

    def forget(self, model: Optional[str] = None) -> None:
        """Empty history and measured view; with ``model``, that model's weights too."""
        self._sessions.pop(model, None)
        self.history, self.test_accuracy, self.measured_timeline = [], None, None
        self.dashboard.clear_measured()

    def start(self, config: Config, calls: int) -> None:
        """Train ``calls`` host calls with ``config`` in the background; returns at once."""
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run_safely, args=(config, calls),
                                        name="ipukit-explorer", daemon=True)
        self.dashboard.set_running(True)
        self._thread.start()

    def stop(self, wait: bool = True, timeout: Optional[float] = 60.0) -> None:
        """Stop after the current call."""
        self._stop.set()
        if wait:
            self.wait(timeout)

    def wait(self, timeout: Optional[float] = None) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def join_interruptibly(self) -> None:
        """Wait for the run; Ctrl-C (a kernel interrupt) stops it after the current call."""
        try:
            while self.running:
                self._thread.join(0.1)
        except KeyboardInterrupt:
            self.stop(wait=True)
            raise

    def _set_error(self, message: Optional[str], failed: bool = False) -> None:
        self.run_error, self.failed = message, failed
        self._on_error()

    def _run_safely(self, config: Config, calls: int) -> None:
        self._set_error(None)
        status = self.dashboard.status
        before = len(self.history)
        try:
            self._train(config, calls)
        except Error as exc:
            self._set_error(logic.check_message(exc))
            done = len(self.history) - before
            status.value = (f"The run stopped after {done} calls: see the message above."
                            if done else "The run did not start: see the message above.")
        except Exception as exc:  # noqa: BLE001 - shown in the dashboard, never a dead thread
            status.value = "<pre>" + traceback.format_exc(limit=3) + "</pre>"
            self._set_error(logic.check_message(exc), failed=True)
        finally:
            if threading.current_thread() is self._thread:
                self.dashboard.set_running(False)

    def _train(self, config: Config, calls: int) -> None:
        session = self.session_for(config.model)
        status = self.dashboard.status
        status.value = f"Compiling and training: {config.describe()}…"
        record = None
        for record in session.run(config, calls, self._stop, compile_lock=self._lock):
            self._record(record)
        if record is None:
            status.value = "Stopped before the first call."
            return
        self._on_done(config, record)
        stopped = " (stopped)" if self._stop.is_set() else ""
        text = (f"Trained {len(self.history)} calls in all{stopped}; last call "
                f"{record['seconds']:.2f} s, {record['samples_per_s']:,.0f} samples/s.")
        if self.evaluate_after_run and session.test_dataset is None:
            session.test_dataset = self.data.test_dataset     # created while not evaluating
        if self.evaluate_after_run and session.test_dataset is not None:
            status.value = text + " Testing…"
            self.test_accuracy = session.evaluate(config, self._test_limit,
                                                  compile_lock=self._lock)
            if self.test_accuracy is not None:
                text += f" Test accuracy {self.test_accuracy:.2f}%."
                self.history[-1]["test_accuracy"] = self.test_accuracy
        status.value = text

    def _record(self, record: Dict[str, Any]) -> None:
        timeline = self.measured_timeline = record.pop("timeline")
        config = record["config"]
        u = logic.utilisation_record(timeline)
        record.update(utilisation=u["per_ipu"], overall=u["overall"])
        self.history.append(record)
        acc = "—" if record["accuracy"] is None else f"{record['accuracy']:.1f}%"
        self.dashboard.status.value = (
            f"Call {record['call']}: loss {record['loss']:.4f}, training accuracy {acc} from "
            f"{record['predictions']:,} of {record['combined_batch']:,} samples "
            f"({config.resolved_output_mode} output), {record['samples_per_s']:,.0f} samples/s.")
        modeled = logic.modeled_timeline(config, self._costs_for(config))
        self.dashboard.show_measured(timeline, self.history, record["call"], modeled)
