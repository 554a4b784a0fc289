# SPDX-License-Identifier: Apache-2.0
"""vLLM's CPU build: the worker, its memory split, its data path (host and
device memory are one; C++ kernels), the query-weight capture before vLLM
prepacks, and Ray executors for the CPU platform."""
