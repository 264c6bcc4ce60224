"""ZeRO stage 3: parameters partitioned into units that module hooks gather exactly while they are needed
(``zero.Init``, ``GatheredParameters``, ``zero.load_state_dict``)."""
