from msprobe_mlflow.cli import main

main(prog_name=main.name)
