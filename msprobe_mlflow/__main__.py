from msprobe_mlflow.commands.cli import main

main(prog_name=main.name)
