"""Shared test set-up: no hub access, ever; control key files in a private temporary folder
(inherited by every engine process a test starts), never in the user's runtime dir."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["VCONSOLE_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="vconsole-test-run-")
