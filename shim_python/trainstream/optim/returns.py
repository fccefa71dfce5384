# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's updated weights on their way back to a CUDA model: the daemon copies each
into the parameter's storage as its update lands, and a module's forward waits only for its
own parameters; paged parameters are read from the host copy instead."""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..transport import device as cuda_device
from .gradients import in_backward

class DeviceReturns:
    """OffloadAdamW's copies back to the device (a part of the class)."""

    def stop_returning(self, param_ids: set) -> None:
        """These parameters' updates are no longer copied to the device (their device memory is
        about to go): waits for copies in flight first. Any of them updated in VRAM go back to
        the daemon first (their weights will be its host copies)."""
        leaving = {i for i, p in enumerate(self.table.params) if id(p) in param_ids}
        moved = leaving & self.table.on_device
        # Paged first: optimizer_mode="gpu" then leaves them to the daemon with the rest.
        self.table.paged |= leaving
        if moved:
            def kept(indices: set) -> set:
                return {id(self.table.params[i]) for i in indices
                        if id(self.table.params[i]) not in param_ids}
            self.keep_state_on_device(kept(self.table.state_in_vram()),
                                      kept(self.table.staged))
        self.synchronize()
        self._module_indices.clear()  # which parameters come back changes
        self._waited_modules.clear()
        for i in sorted(leaving):
            if self._device_return and self._targets[i] != 0:
                self._host.retarget_device(i, 0, 0)
                self._targets[i] = 0

    def resume_returning(self, param_ids: set) -> None:
        """These parameters hold device tensors again (blocks that stopped streaming): their
        updates are copied there from the next step on."""
        self.synchronize()
        self._module_indices.clear()  # which parameters come back changes
        self._waited_modules.clear()
        for i, p in enumerate(self.table.params):
            if id(p) in param_ids and i in self.table.paged:
                self.table.paged.discard(i)
                if self._device_return:
                    self._host.retarget_device(i, p.data_ptr(), p.numel() * p.element_size())
                    self._targets[i] = p.data_ptr()
        if self._update_on_gpu:  # optimizer_mode="gpu": they are updated on the GPU again
            self.keep_state_on_device({id(self.table.params[i]) for i in
                                       self.table.state_in_vram()})

    def page_weights(self, pager: Any) -> None:
        """Parameters of ``pager``'s blocks are read from host memory at every use: their
        updates are not copied back, and each step tells the pager the host copies changed."""
        self._pager = pager
        self.stop_returning({id(p) for params in pager.weights.params.values() for p in params})

    def _check_targets(self) -> None:
        if not self._device_return:
            return
        moved = [i for i, p in enumerate(self.table.params)
                 if self.table.returned(i) and p.data_ptr() != self._targets[i]]
        if moved:
            # The old storage may be reused already: nothing may still be copying into it.
            self._host.synchronize_device_returns()
        for i in moved:
            # Someone gave the parameter new storage (p.data = ...): copy there from now on.
            p = self.table.params[i]
            self._host.retarget_device(i, p.data_ptr(), p.numel() * p.element_size())
            self._targets[i] = p.data_ptr()

    def _wait_for_own_parameters(self, module: Any, args: Any) -> None:
        self._settle_updates()  # a submodule called on its own, say
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
            index = self.table.index
            indices = [index[id(p)] for p in module.parameters(recurse=key in self._wait_blocks)
                       if id(p) in index and self.table.returned(index[id(p)])]
            self._module_indices[key] = indices
        if not indices:
            return
        stream = cuda_device.current(self._device_index)
        if self._ready:
            for i in indices:
                event = self._ready.pop(id(self.table.params[i]), None)
                if event is not None:
                    stream.wait_event(event)
        if self._device_return:
            self._host.wait_for_parameters(indices, stream.cuda_stream)

    def attach_forward_waits(self, model: torch.nn.Module, blocks: Iterable[Any] = ()) -> None:
        """Makes each module's forward wait for its own parameters' new values (CUDA), and a
        forward between the last backward and step() wait for every update (CPU too).
        Each of ``blocks`` (the repeated layers, each a module the model calls: a ModuleList of
        a layer's parts is iterated, not called, and has no forward to hook) waits once, for
        every trained parameter inside it: one hook where a LoRA block would have seven, and
        none that a recomputed block's second forward calls again (its updates cannot have come back
        by then)."""
        if id(model) not in self._hooked_models:
            # A forward or a checkpoint between the last backward and step() completes the
            # iteration first, on a CPU too (updates land in place there).
            self._hooked_models.add(id(model))
            self._hooks.append(model.register_forward_pre_hook(
                lambda module, args: self._settle_updates()))
            if hasattr(model, "register_state_dict_pre_hook"):
                self._hooks.append(model.register_state_dict_pre_hook(
                    lambda module, prefix, keep_vars: self._settle_updates()))
        if not self._cuda:
            return
        self._model = model
        self._wait_blocks.update({id(b): b for b in blocks})
        inside_blocks = {id(m) for b in self._wait_blocks.values() for m in b.modules()}
        candidates = [(b, True) for b in self._wait_blocks.values()] + [
            (m, False) for m in model.modules() if id(m) not in inside_blocks]
        for module, whole in candidates:
            if id(module) in self._hooked_modules:
                continue
            # Only modules that own a trained parameter have copies to wait for (a frozen
            # base's layers get none): a pre-hook on every module costs each forward a call.
            if any(id(p) in self.table.index for p in module.parameters(recurse=whole)):
                self._hooked_modules.add(id(module))
                self._hooks.append(module.register_forward_pre_hook(self._forward_wait_timed))
        self._module_indices.clear()  # parameters may have been added since
        if hasattr(model, "register_state_dict_pre_hook") and id(model) not in self._hooked_dicts:
            self._hooked_dicts.add(id(model))
            # A checkpoint reads every weight outside forward: let the copies land first.
            self._hooks.append(model.register_state_dict_pre_hook(
                lambda module, prefix, keep_vars: self.synchronize()))

    def refresh_weights(self) -> None:
        """Brings the model's weights to the daemon's (after a load, or when joining a job whose
        state another rank created). CPU weights are the daemon's memory already."""
        if self._cuda:
            if self._device_return:
                # A returning copy still in flight must not land after these.
                self._host.synchronize_device_returns()
            for i, p in enumerate(self.table.params):
                if i in self.table.paged:
                    continue  # read from the host copy at its next use
                self._host.param_buffer(i).copy_to_device(p.data, stream=self._copy_stream)
            self._copy_stream.synchronize()
        if self._pager is not None:
            self._pager.weights_changed()
