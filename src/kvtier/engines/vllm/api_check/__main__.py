"""``python -m kvtier.engines.vllm.api_check [WHEEL...]``: what does not hold of kvtier against
each wheel's vLLM (no argument: against the installed vLLM, read, then imported)."""

import sys

from kvtier.engines.vllm.api_check.checks import main

sys.exit(main(sys.argv[1:]))
