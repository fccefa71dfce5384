# SPDX-License-Identifier: Apache-2.0
"""OffloadAdamW's state in and out: torch's state_dict form (the moments fetched from the
daemon, or wherever each parameter's state lives now) and the daemon's own checkpoint files
(save/load, written by trainstreamd)."""

from __future__ import annotations

import torch

from .groups import daemon_group

class Checkpoints:
    """OffloadAdamW's checkpoints (a part of the class)."""

    def state_dict(self) -> dict:
        """``torch.optim.AdamW``-compatible, plus ``"master"``: the fp32 master weights."""
        if self.auto.optimizer is not None:
            return self.auto.optimizer.state_dict()
        self.settle_updates()  # between the last backward and step(): the updated state
        if self.placement.engine is not None:
            self.placement.engine.synchronize()  # the daemon's moments of staged ones are current
        ours = self.host.state_dict()
        for i in self.table.on_device:  # the VRAM-held state, as it is now
            p = self.table.params[i]
            if i in self.table.staged:
                entry = None
                steps = self.placement.engine.steps_of(i)
                if steps:
                    entry = {"step": torch.tensor(float(steps)),
                             "exp_avg": self.host.exp_avg(i),
                             "exp_avg_sq": self.host.exp_avg_sq(i)}
            else:
                entry = self.placement.device_optimizer.state.get(p)
            ours["state"].pop(i, None)
            if entry:
                # fp32 moments, as the daemon's own state_dict gives them (bf16 ones upcast).
                ours["state"][i] = {"step": entry["step"].detach().cpu().clone(),
                                    "exp_avg": entry["exp_avg"].detach().float().cpu().clone(),
                                    "exp_avg_sq": entry["exp_avg_sq"].detach().float().cpu()
                                    .clone()}
            master = self.placement.mapped_master(i)  # the GPU kernel's, finer than a bf16 weight
            ours["master"][i] = (master if master is not None else p.detach()).float().cpu().clone()
        position = {id(p): n for n, p in enumerate(self.table.all)}
        state = {position[id(self.table.params[i])]: entry for i, entry in ours["state"].items()}
        groups = []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry.update(amsgrad=False, maximize=False, foreach=None, capturable=False,
                         differentiable=False, fused=None)
            entry["params"] = [position[id(p)] for p in g["params"]]
            groups.append(entry)
        return {"state": state, "param_groups": groups, "master": ours["master"],
                "iteration": ours["iteration"]}

    def load_state_dict(self, state_dict: dict) -> None:
        self.settle_updates()  # the updates landing now would write over what is loaded
        self.synchronize()  # and so would copies still in flight (staged moments, weights)
        if "master" not in state_dict:
            # The weights stay as they are: the daemon's master of the VRAM-held ones first
            # catches up, since the load copies every master back to the model.
            self.placement.state_to_daemon()
        if self.auto.optimizer is not None:
            if "master" in state_dict:
                with torch.no_grad():
                    for p, master in zip(self.table.params, state_dict["master"]):
                        p.copy_(master.reshape(p.shape))
            self.auto.optimizer.load_state_dict(
                {k: v for k, v in state_dict.items() if k in ("state", "param_groups")})
            return
        position = {id(p): n for n, p in enumerate(self.table.all)}
        ours_state = {}
        for i, p in enumerate(self.table.params):
            key = position[id(p)]
            if key in state_dict["state"]:
                ours_state[i] = state_dict["state"][key]
        index = self.table.index
        groups = [dict(g, params=[index[id(p)] for p in mine["params"] if p.requires_grad])
                  for g, mine in zip(state_dict["param_groups"], self.param_groups)]
        converted = {"state": ours_state, "param_groups": groups}
        if "master" in state_dict:
            converted["master"] = state_dict["master"]
        if "iteration" in state_dict:
            converted["iteration"] = state_dict["iteration"]
        self.host.load_state_dict(converted)
        for g, loaded in zip(self.param_groups, state_dict["param_groups"]):
            for key in ("lr", "betas", "eps", "weight_decay"):
                g[key] = loaded[key]
        self._pushed = [daemon_group(g) for g in self.param_groups]
        self.refresh_weights()
        self.placement.state_from_daemon()

    def save(self, path: str) -> int:
        """Checkpoints the optimizer state by the daemon (atomic rename)."""
        self.settle_updates()  # between the last backward and step(): the updated state
        if self.auto.optimizer is not None:
            # The state lives in VRAM now: hand the daemon a copy, then let it write the file.
            self.auto.state_to_daemon(daemon_group(g) for g in self.param_groups)
        self.placement.state_to_daemon()
        return self.host.save(path)

    def load(self, path: str) -> None:
        self.settle_updates()  # the updates landing now would write over what is loaded
        self.synchronize()  # and so would copies still in flight (staged moments, weights)
        self.host.load(path)
        self.refresh_weights()
        self.placement.state_from_daemon()
        if self.auto.optimizer is not None:
            # The GPU optimizer continues from the checkpoint's moments and steps.
            self.auto.state_from_daemon()
            self.auto.count_from(self.host.iteration)
