# SPDX-License-Identifier: Apache-2.0
"""Frozen bases: models' weights loaded once into the daemon (bf16 or quantized), shared by every
process that trains adapters over them, on the host or in GPU pools, and the linear layers that
compute with them. Named apart from the public ``trainstream.bases()``, which lists them."""
