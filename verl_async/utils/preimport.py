"""Import transformers' model stack in a background thread while the process waits on something else (start-up).

A trainer rank or an engine replica spends seconds importing `transformers.modeling_utils` and what it pulls
(torch's DTensor, dynamo, sympy; 6-7 s of a rank's start on a GPU host, bench/RESULTS.md "Start-up") before its
model loads. Started as soon as the process's device is chosen, the import runs while the main thread waits on
things that release the GIL: the accelerator's context, the process group's rendezvous, the trainer's first calls.
`wait()` then takes what is left; the main thread's own imports find the modules loaded. A failure here is
dropped: the main thread's import raises it where it always did.
"""

from __future__ import annotations

import importlib
import json
import os
import threading
from typing import Optional, Sequence

# what resolve_attn_implementation, load_hf_config and load_causal_lm import (the model's own module comes from
# its config.json)
MODEL_STACK = (
    "transformers",
    "transformers.modeling_utils",
    "transformers.masking_utils",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.modeling_auto",
)


def model_modules(model_path: Optional[str]) -> list[str]:
    """The model family's configuration and modeling modules, from the folder's config.json (none: unknown)."""
    try:
        with open(os.path.join(str(model_path), "config.json")) as f:
            model_type = str(json.load(f).get("model_type") or "")
    except (OSError, ValueError, TypeError):
        return []
    if not model_type.isidentifier():
        return []
    return [f"transformers.models.{model_type}.configuration_{model_type}",
            f"transformers.models.{model_type}.modeling_{model_type}"]


class BackgroundImport:
    """Import `modules`, in order, in a daemon thread started at once."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = tuple(modules)
        self.failed: list[str] = []
        self._thread = threading.Thread(target=self._run, name="preimport", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for name in self.modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 - the main thread's own import reports it
                self.failed.append(name)

    def wait(self, timeout_s: float = 600.0) -> bool:
        """Block until the imports ended (True), or `timeout_s` passed (False: the main thread goes on importing)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def import_model_stack(model_path: Optional[str], extra: Sequence[str] = ()) -> BackgroundImport:
    """Start importing the model stack (plus `extra`) for the model in `model_path`."""
    return BackgroundImport([*MODEL_STACK, *model_modules(model_path), *extra])
