"""``python -m triclip ...`` == ``triclip ...``; for torchrun (one process per GPU or CPU rank):

    torchrun --nproc_per_node K -m triclip train --train-data P --val-data P --out RUN ...
"""

import sys

from triclip.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
