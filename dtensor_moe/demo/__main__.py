"""``python -m dtensor_moe.demo``: see ``python -m dtensor_moe.demo --help``."""

import sys

from dtensor_moe.demo.launch import main

sys.exit(main())
