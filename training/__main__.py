"""``python -m training ...`` == ``triclip train ...``; for torchrun:

    torchrun --nproc_per_node K -m training --train-data P --val-data P --out RUN ...
"""

import sys

from app.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
