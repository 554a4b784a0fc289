# SPDX-License-Identifier: Apache-2.0
"""Skewing (front end and worker): ``calibration.py`` computes the skew from
text (``vllm-infinigen prepare``, or an engine start without a skew file);
``tables.py`` saves, fingerprints, caches and checks skew files, which every
worker loads."""
