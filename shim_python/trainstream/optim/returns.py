# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's updated weights on their way back to a CUDA model: the daemon copies each
into the parameter's storage as its update lands, and a module's forward waits only for its
own parameters; paged parameters are read from the host copy instead."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from ..transport import device as cuda_device
from .gradients import in_backward
from .iteration import Iteration
from .parameters import ParameterTable


class DeviceReturns:
    """Where each parameter's update goes back to, and who waits for it. With every returned
    parameter contiguous, the daemon's native side copies an update into the parameter's
    storage the moment it lands (``direct``: it holds each parameter's target address);
    otherwise the whole step's updates are copied at step() on the side stream, one event each.
    Each module's forward waits only for its own parameters, once per step.

    ``settle`` completes an iteration whose last backward has ended (a forward before step()
    reads every update); ``synchronize`` waits for every copy in either direction (the
    optimizer's); ``add_hook`` keeps a hook handle for the optimizer's detach()."""

    def __init__(self, *, host: Any, table: ParameterTable, iteration: Iteration,
                 device_index: int, copy_stream: Any, clock: Any, placeholders: set,
                 settle: Callable[[], None], synchronize: Callable[[], None],
                 add_hook: Callable[[Any], None]) -> None:
        self._host = host
        self._table = table
        self._iteration = iteration
        self._cuda = device_index >= 0
        self._device_index = device_index
        self._copy_stream = copy_stream
        self._settle = settle
        self._synchronize = synchronize
        self._add_hook = add_hook
        self._forward_wait_timed = clock.timed("optimizer.forward_wait",
                                               self.wait_for_own_parameters)
        params = table.params
        # ``placeholders``: ids of streamed weights wrap() left on the CPU (device
        # placeholders, never copied to).
        self.direct = self._cuda and all(p.is_contiguous() for p in params
                                         if id(p) not in placeholders)
        self._targets: list[int] = []  # each parameter's storage the daemon copies into
        self._ready: dict[int, Any] = {}  # not direct: the copy's event, by parameter id
        self._module_indices: dict[int, list[int]] = {}
        self._waited_modules: set[int] = set()  # modules whose forward waited since step()
        self._hooked_modules: set[int] = set()
        self._wait_blocks: dict[int, Any] = {}  # blocks that wait for everything inside them
        self._hooked_dicts: set[int] = set()
        self._hooked_models: set[int] = set()
        self.model: Any = None  # the model whose forwards wait (attach_forward_waits)
        if self.direct:
            self._targets = [0 if id(p) in placeholders else p.data_ptr() for p in params]
            first = params[0].device
            host.return_updates_to_device(
                first.index if first.index is not None else torch.cuda.current_device(),
                [(0, 0) if id(p) in placeholders else (p.data_ptr(), p.numel() * p.element_size())
                 for p in params])

    def extend(self, params: list) -> None:
        """Parameters that joined the table (add_param_group): theirs come back too."""
        if self.direct:
            self._targets += [p.data_ptr() for p in params]
            self._host.add_device_targets([(p.data_ptr(), p.numel() * p.element_size())
                                           for p in params])

    def retarget(self, i: int, returned: bool) -> None:
        """Parameter ``i``'s updates are copied to its storage from now on (``returned``), or
        nowhere (paged, or updated in VRAM)."""
        if not self.direct:
            return
        p = self._table.params[i]
        target = p.data_ptr() if returned else 0
        if self._targets[i] != target:
            self._host.retarget_device(i, target, p.numel() * p.element_size() if returned else 0)
            self._targets[i] = target

    def check_targets(self) -> None:
        """At an iteration's first gradient: a parameter given new storage (``p.data = ...``)
        gets its copies there from now on."""
        if not self.direct:
            return
        table = self._table
        moved = [i for i, p in enumerate(table.params)
                 if table.returned(i) and p.data_ptr() != self._targets[i]]
        if moved:
            # The old storage may be reused already: nothing may still be copying into it.
            self._host.synchronize_device_returns()
        for i in moved:
            self.retarget(i, True)

    def forget_waits(self) -> None:
        """Which parameters come back changed: each module's set is found again, and each
        forward waits again."""
        self._module_indices.clear()
        self._waited_modules.clear()

    def updates_sent(self, updated: list) -> int:
        """The iteration's updates (``updated[i]``) are all on their way back: the next forward
        of each module waits again. Not direct: their copies start here. Returns the bytes that
        come back."""
        self._waited_modules.clear()
        if not self._cuda:
            return 0
        table = self._table
        back = [i for i, p in enumerate(table.params) if updated[i] and i not in table.paged]
        if not self.direct:
            stream = self._copy_stream
            for i in back:
                p = table.params[i]
                self._host.param_buffer(i).copy_to_device(p.data, stream=stream)
                event = torch.cuda.Event()
                event.record(stream)
                self._ready[id(p)] = event
        return sum(table.params[i].numel() * table.params[i].element_size() for i in back)

    def synchronize(self) -> None:
        """Blocks until every copy back has landed."""
        if self._copy_stream is not None:
            self._copy_stream.synchronize()
            self._ready.clear()
        if self.direct:
            self._host.synchronize_device_returns()

    def refresh(self) -> None:
        """Every returned parameter takes the daemon's weights now (after a load)."""
        if not self._cuda:
            return
        if self.direct:
            # A returning copy still in flight must not land after these.
            self._host.synchronize_device_returns()
        for i, p in enumerate(self._table.params):
            if i in self._table.paged:
                continue  # read from the host copy at its next use
            self._host.param_buffer(i).copy_to_device(p.data, stream=self._copy_stream)
        self._copy_stream.synchronize()

    def wait_for_own_parameters(self, module: Any, args: Any) -> None:
        self._settle()  # a submodule called on its own, say
        key = id(module)
        if key in self._waited_modules and (not self._iteration.updates_landing or in_backward()):
            # Waited on since the last step(), and no update of its own can have come back
            # since: updates land only once the last backward before step() has produced
            # their gradients, after the module's last forward or recompute in it. (A forward
            # between that backward and step(), an evaluation say, waits again.)
            return
        self._waited_modules.add(key)
        # The module's trained parameters whose updates come back to the device (a streamed
        # block's are read from the host copy at each fetch: nothing to wait for).
        indices = self._module_indices.get(key)
        if indices is None:
            table = self._table
            index = table.index
            indices = [index[id(p)] for p in module.parameters(recurse=key in self._wait_blocks)
                       if id(p) in index and table.returned(index[id(p)])]
            self._module_indices[key] = indices
        if not indices:
            return
        stream = cuda_device.current(self._device_index)
        if self._ready:
            for i in indices:
                event = self._ready.pop(id(self._table.params[i]), None)
                if event is not None:
                    stream.wait_event(event)
        if self.direct:
            self._host.wait_for_parameters(indices, stream.cuda_stream)

    def attach_forward_waits(self, model: torch.nn.Module, blocks: Iterable[Any] = ()) -> None:
        """Makes each module's forward wait for its own parameters' new values (CUDA), and a
        forward between the last backward and step() wait for every update (CPU too).
        Each of ``blocks`` (the repeated layers, each a module the model calls: a ModuleList of
        a layer's parts is iterated, not called, and has no forward to hook) waits once, for
        every trained parameter inside it: one hook where a LoRA block would have seven, and
        none that a recomputed block's second forward calls again (its updates cannot have come
        back by then)."""
        settle = self._settle
        if id(model) not in self._hooked_models:
            # A forward or a checkpoint between the last backward and step() completes the
            # iteration first, on a CPU too (updates land in place there).
            self._hooked_models.add(id(model))
            self._add_hook(model.register_forward_pre_hook(lambda module, args: settle()))
            if hasattr(model, "register_state_dict_pre_hook"):
                self._add_hook(model.register_state_dict_pre_hook(
                    lambda module, prefix, keep_vars: settle()))
        if not self._cuda:
            return
        self.model = model
        self._wait_blocks.update({id(b): b for b in blocks})
        inside_blocks = {id(m) for b in self._wait_blocks.values() for m in b.modules()}
        candidates = [(b, True) for b in self._wait_blocks.values()] + [
            (m, False) for m in model.modules() if id(m) not in inside_blocks]
        index = self._table.index
        for module, whole in candidates:
            if id(module) in self._hooked_modules:
                continue
            # Only modules that own a trained parameter have copies to wait for (a frozen
            # base's layers get none): a pre-hook on every module costs each forward a call.
            if any(id(p) in index for p in module.parameters(recurse=whole)):
                self._hooked_modules.add(id(module))
                self._add_hook(module.register_forward_pre_hook(self._forward_wait_timed))
        self._module_indices.clear()  # parameters may have been added since
        if hasattr(model, "register_state_dict_pre_hook") and id(model) not in self._hooked_dicts:
            self._hooked_dicts.add(id(model))
            # A checkpoint reads every weight outside forward: let the copies land first.
            synchronize = self._synchronize
            self._add_hook(model.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: synchronize()))
