import sys

from service.cli import main_serve

main_serve(sys.argv[1:])
