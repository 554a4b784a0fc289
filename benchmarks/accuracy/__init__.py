# SPDX-License-Identifier: Apache-2.0
"""Accuracy under decode-time selection: teacher forcing and perplexity."""
