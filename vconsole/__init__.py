"""vconsole: a live LLM inference engine and the terminal console that watches and steers it."""

# The release, as pyproject.toml's [project] version says it (a test holds the two equal): read
# here, not from the installed metadata, so `vconsole --version` and the server's /version say it
# without importing importlib.metadata, and say it from a source tree that was never installed.
__version__ = "0.1.0"
