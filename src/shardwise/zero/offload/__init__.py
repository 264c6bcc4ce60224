"""Offload to NVMe (ZeRO-Infinity): the files a rank's state lives in, their checksums, room on the disk, read
ahead and write behind, and stage 3's parameter shards kept in files."""
