# SPDX-License-Identifier: Apache-2.0
"""The memory plan: what of a model lives in VRAM, what streams from the host (weights,
activations) and what is recomputed; the planner, the pager that carries it out and the
adaptive plan that measures and corrects it while training."""
