"""The interactive console of `python infer.py`.

- `settings`: the settings and the parsers of their values
- `commands`: the /commands, one handler each, and /help built from them
- `models`: loading, which drafter fits a target, running one decoding method
- `render`: the debug view, its legend, the results and status tables
- `app`: the chat loop (`ChatConsole`)
- `cli`: the command-line options and start-up (`main`)
"""
