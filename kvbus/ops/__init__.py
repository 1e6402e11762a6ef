"""Operations: ``kvbus top`` (the fleet's model apart from its drawing) and ``kvbus
compact`` (snapshots for late consumers). Module map: README.md in this folder."""
