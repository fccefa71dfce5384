# SPDX-License-Identifier: Apache-2.0
"""Other libraries' models and losses: Hugging Face ``transformers`` models over shared bases,
and the causal-LM loss computed from the hidden states in chunks."""
