# SPDX-License-Identifier: Apache-2.0
"""What the benchmarks and the tests share: paths, models, engines, servers, request mixes.

- ``paths``: the repository, ``../shared`` (models and data), the bundled
  model and the results directory.
- ``models``: tiny random Hugging Face models built from seeds, and the
  cached long-context models of the performance benchmarks.
- ``engines``: offline ``LLM`` engines started and shut down as context
  managers (``vllm_infinigen.register()`` first), and the select-all setting.
- ``servers``: ``vllm serve`` processes: start, watch, stop, read /metrics.
- ``request_mix``: seeded mixes of OpenAI completion requests and the client
  that sends them to a server.
- ``report``: result files (JSON with provenance, Markdown, PNG).

Run every benchmark from the repository root as a module
(``python -m benchmarks.perf.decode_latency ...``); nothing edits ``sys.path``.
"""
