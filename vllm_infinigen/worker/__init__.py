# SPDX-License-Identifier: Apache-2.0
"""Worker side, platform-neutral: the runtime that runs each step layer by layer,
the attention-impl wrapper that calls it, the step plan, the layer state, the
pool index, and the ``DataPath`` seam a platform implements (``platforms/``)."""
