# SPDX-License-Identifier: Apache-2.0
"""Oracles the tests hold the product to (never imported by the package): pure-torch
references, and recorded outputs of other tools with their provenance."""
