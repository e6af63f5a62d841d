package io.binx.trino;

import io.trino.spi.exchange.ExchangeManager;
import io.trino.spi.exchange.ExchangeManagerContext;
import io.trino.spi.exchange.ExchangeManagerFactory;
import java.util.Map;

/** Makes the {@code binx} exchange manager from its properties (see {@link BinxExchangeConfig}). */
public class BinxExchangeManagerFactory implements ExchangeManagerFactory {
    public static final String NAME = "binx";

    @Override
    public String getName() {
        return NAME;
    }

    @Override
    public ExchangeManager create(Map<String, String> config, ExchangeManagerContext context) {
        return new BinxExchangeManager(BinxExchangeConfig.from(config));
    }
}
