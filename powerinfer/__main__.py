from powerinfer.cli import app

app(prog_name="powerinfer")
