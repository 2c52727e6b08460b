import sys

try:
    from powerinfer.cli import app
except KeyboardInterrupt:  # Ctrl-C in the first fraction of a second: one line, as everywhere else
    sys.stderr.write("interrupted\n")
    sys.exit(130)

app(prog_name="powerinfer")
