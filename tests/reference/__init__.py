# SPDX-License-Identifier: Apache-2.0
"""Pure-torch oracles the tests hold the product to (never imported by the package)."""
