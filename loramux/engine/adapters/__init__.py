"""The adapters' life inside the engine: loads beside the step loop (`AdapterLoader`), who uses
each adapter (`AdapterUses`, what the scheduler asks), the one owner of it all, from name to
GPU slot to retirement (`AdapterLifecycle`), and the engine's methods that reach it
(`EngineAdapterAPI`: ``add_lora``, ``remove_lora``, ...)."""
