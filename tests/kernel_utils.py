"Running code in a real Jupyter kernel from a test (what a user's notebook does)."
from textwrap import dedent


def run_cell(kc, code: str, timeout: float = 240):
    "Execute `code` in the kernel behind client `kc`; return (stdout text, None or (error name, value, traceback))."
    msg_id = kc.execute(dedent(code))
    out, err = [], None
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id: continue
        t, c = msg["msg_type"], msg["content"]
        if t == "stream": out.append(c["text"])
        elif t == "error": err = (c["ename"], c["evalue"], "\n".join(c["traceback"]))
        elif t == "status" and c["execution_state"] == "idle": return "".join(out), err
