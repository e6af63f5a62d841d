package io.binx.trino;

import io.trino.spi.Plugin;
import io.trino.spi.exchange.ExchangeManagerFactory;
import java.util.List;

/** Trino's entry point: the exchange manager {@code binx} (exchange-manager.name=binx). */
public class BinxExchangePlugin implements Plugin {
    @Override
    public Iterable<ExchangeManagerFactory> getExchangeManagerFactories() {
        return List.of(new BinxExchangeManagerFactory());
    }
}
