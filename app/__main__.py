"""``python -m app ...`` == ``triclip ...``; for torchrun (one process per GPU or CPU rank):

    torchrun --nproc_per_node K -m app train --train-data P --val-data P --out RUN ...
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main())
