"""Keep library chatter (progress bars, warnings) off stdout and out of the logs."""

from __future__ import annotations

import os


def quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
