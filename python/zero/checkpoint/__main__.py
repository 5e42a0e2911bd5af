"""python -m zero.checkpoint SAVE_DIR OUTPUT [--tag TAG] [--with-optimizer]"""
import sys

from zero.checkpoint._command import main

sys.exit(main())
