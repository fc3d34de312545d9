"""``python -m nemo_cudagraph_plugin.integrations.nemo RECIPE [--cuda-graph] [--check] [--yaml PATH]``."""

import sys

from .cli import main

sys.exit(main())
