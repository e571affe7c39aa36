"""Drives `sluice ... sql` (the interactive shell) in a pseudo-terminal, as a person would: waits for
each prompt, types the next line, and prints what the terminal shows at the end (stdout and stderr
share it), as a 100-column screen would show it after every cursor move and erase: a progress line
that was cleared is gone, one that was left behind is there. Stdlib only.

Usage: shell_pty.py LINES_FILE -- COMMAND...  (SHELL_PTY_RAW=FILE also keeps the raw bytes)
"""

import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import time

PROMPT = b"sluice> "
COLUMNS = 100


def screen(data):
    """The lines a terminal shows after `data` (text, CSI sequences for cursor moves and erases)."""
    lines = [[]]
    row, col = 0, 0

    def line():
        while len(lines) <= row:
            lines.append([])
        return lines[row]

    i = 0
    while i < len(data):
        ch = data[i]
        if ch == "\x1b":
            match = re.match(r"\x1b\[([?0-9;]*)([A-Za-z@])", data[i:])
            if not match:
                i += 2
                continue
            params, final = match.group(1), match.group(2)
            n = int(params) if params.isdigit() else None
            if final == "A":
                row = max(0, row - (n or 1))
            elif final == "B":
                row += n or 1
            elif final == "C":
                col += n or 1
            elif final == "D":
                col = max(0, col - (n or 1))
            elif final == "G":
                col = (n or 1) - 1
            elif final == "K":
                current = line()
                if n in (None, 0):
                    del current[col:]
                elif n == 1:
                    current[:col] = [" "] * min(col, len(current))
                else:
                    current.clear()
            elif final == "J":
                del line()[col:]
                del lines[row + 1 :]
            i += len(match.group(0))
            continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
            col = 0
            line()
        elif ch == "\b":
            col = max(0, col - 1)
        elif ch >= " ":
            if col >= COLUMNS:
                # A terminal wraps when a character follows a full line, not when it fills it.
                row += 1
                col = 0
            current = line()
            while len(current) < col:
                current.append(" ")
            if col < len(current):
                current[col] = ch
            else:
                current.append(ch)
            col += 1
        i += 1
    text = ["".join(chars).rstrip() for chars in lines]
    while text and not text[-1]:
        text.pop()
    return "\n".join(text) + "\n"


def main():
    split = sys.argv.index("--")
    lines = open(sys.argv[1]).read().splitlines()
    command = sys.argv[split + 1 :]
    pid, fd = pty.fork()
    if pid == 0:
        os.environ["TERM"] = "xterm"
        os.environ["COLUMNS"] = str(COLUMNS)
        os.environ["LINES"] = "50"
        os.execvp(command[0], command)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, COLUMNS, 0, 0))
    seen = b""
    deadline = time.monotonic() + 300
    pending = list(lines)
    prompts = 0
    while True:
        if time.monotonic() > deadline:
            # A shell that hangs fails the run instead of hanging it.
            os.kill(pid, 9)
            break
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
        if seen.count(PROMPT) > prompts:
            prompts = seen.count(PROMPT)
            if pending:
                os.write(fd, pending.pop(0).encode() + b"\r")
    _, status = os.waitpid(pid, 0)
    if os.environ.get("SHELL_PTY_RAW"):
        with open(os.environ["SHELL_PTY_RAW"], "wb") as raw:
            raw.write(seen)
    sys.stdout.write(screen(seen.decode("utf-8", "replace")))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
