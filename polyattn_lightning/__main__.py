"""``python -m polyattn_lightning fit --config ...``"""
from .cli import main

main()
