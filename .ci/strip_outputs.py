"""Git's clean filter for notebooks (`make` configures it; .gitattributes applies it to *.ipynb): what nbdev_clean
writes, with every output and execution count cleared. A notebook run in JupyterLab then reads as committed to
`git status` and `git diff`, while the file on disk keeps its outputs. Run by git from the repository's top folder, on
stdin to stdout. (`nbdev_clean --stdin` of nbdev 2.4.14 writes nothing at all, so it cannot be the filter.)"""
import sys

from execnb.nbio import loads, nb2str
from nbdev.clean import clean_nb
from nbdev.config import get_config

cfg = get_config()
nb = loads(sys.stdin.buffer.read().decode("utf-8"))
clean_nb(nb, True, cfg.get("allowed_metadata_keys").split(), cfg.get("allowed_cell_metadata_keys").split(),
         cfg.clean_ids)
# JupyterLab's saved widget state: nbdev keeps it (its docs draw it); a commit does not
nb["metadata"].pop("widgets", None)
sys.stdout.buffer.write(nb2str(nb).encode("utf-8"))
