from torchspeed.cli.main import run

run()
