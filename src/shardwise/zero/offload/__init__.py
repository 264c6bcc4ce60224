"""Offload of stage 3's shards and of the optimizer state's files (ZeRO-Offload, ZeRO-Infinity): the files a rank's
state lives in and their checksums, the folders they are in and room on the disk, and the shards kept in files or in
host memory."""
