# SPDX-License-Identifier: Apache-2.0
"""Scheduler side (vLLM's engine core): the sparse layers' KV-cache spec and
block-less manager, the KV connector that carries the workers' counters, and
the metrics it exports."""
