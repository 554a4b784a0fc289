# SPDX-License-Identifier: Apache-2.0
"""Oracles the tests hold the product to (never imported by the package): pure-torch
references, and recorded outputs of other tools with their provenance; and the
inputs that several test modules build alike (a runtime step, a pool written
through the kernels, the CUDA kernels' arguments): test modules import from here,
never from one another."""
