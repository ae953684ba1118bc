import sys

from msprobe_mlflow.cli import main

sys.exit(main())
