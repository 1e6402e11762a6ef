"""Old import paths keep working: before 0.3 every module lived flat in `kvbus/`
(`from kvbus.index import PrefixIndex`); they now live in subpackages that show the
layers (`kvbus.routing.index`). A finder on `sys.meta_path` answers an old name with
the module itself (the same object, so patching either patches both) and a
DeprecationWarning. `kvbus.subscribe` is not aliased: it names the public function,
and importing a module under that name would replace it on the package."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Final

MOVED: Final[dict[str, str]] = {
    "kvbus.envelope": "kvbus.wire.envelope",
    "kvbus.events": "kvbus.wire.events",
    "kvbus.snapshot": "kvbus.wire.snapshot",
    "kvbus.publisher": "kvbus.bus.publisher",
    "kvbus.sequencer": "kvbus.bus.sequencer",
    "kvbus.source_state": "kvbus.bus.source_state",
    "kvbus.retry": "kvbus.bus.retry",
    "kvbus.index": "kvbus.routing.index",
    "kvbus.kernels": "kvbus.routing.kernels",
    "kvbus._kernels": "kvbus.routing._kernels",
    "kvbus.router": "kvbus.routing.router",
    "kvbus.router_state": "kvbus.routing.fleet_state",
    "kvbus.router_cost": "kvbus.routing.cost",
    "kvbus.router_peers": "kvbus.routing.peers",
    "kvbus.transfers": "kvbus.routing.transfers",
    "kvbus.gateway": "kvbus.service.gateway",
    "kvbus.router_http": "kvbus.service.handlers",
    "kvbus.upstream": "kvbus.service.upstream",
    "kvbus.bus_followers": "kvbus.service.bus_followers",
    "kvbus.bus_watch": "kvbus.service.bus_watch",
    "kvbus.served_model": "kvbus.service.served_model",
    "kvbus.router_metrics": "kvbus.service.router_metrics",
    "kvbus.worker_names": "kvbus.service.worker_names",
    "kvbus.top": "kvbus.ops.top",
    "kvbus.fleet_view": "kvbus.ops.fleet_view",
    "kvbus.compact": "kvbus.ops.compact",
    "kvbus._prometheus": "kvbus.metrics.prometheus",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `MOVED`'s old names; loading one puts the new module in its place."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a throwaway module: exec_module replaces it

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        warnings.warn(
            f"{old} moved to {MOVED[old]}; import it from there",
            DeprecationWarning,
            stacklevel=2,
        )
        # The import system reads sys.modules again after exec_module: the importer
        # gets the real module, not a copy (its globals are the ones kvbus uses).
        sys.modules[old] = importlib.import_module(MOVED[old])


def install() -> None:
    """Adds the finder once (`import kvbus` calls it)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
